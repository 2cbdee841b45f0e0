"use strict";
// Shared by the coordinator and the upload page: requests to the service's JSON API with a
// Bearer token, its one-line refusals, element building and number formatting.

const fk = {
  /** A request to the JSON API; throws an Error whose message is the server's refusal. */
  async request(method, path, token, body) {
    const headers = {Authorization: "Bearer " + token};
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, {method, headers, cache: "no-store",
                                    body: body === undefined ? undefined : JSON.stringify(body)});
    } catch (err) {
      throw new Error("cannot reach the server (" + err.message + ")");
    }
    if (!response.ok) {
      const error = new Error(fk.refusal(response.status, await response.text()));
      error.status = response.status;
      throw error;
    }
    return response;
  },

  async json(method, path, token, body) {
    return (await fk.request(method, path, token, body)).json();
  },

  /** The one line of a JSON refusal {"error": ...}, with its HTTP status. */
  refusal(status, text) {
    let error = "";
    try {
      error = JSON.parse(text).error || "";
    } catch (err) {
      error = (text || "").slice(0, 200);
    }
    return (error || "refused") + " (HTTP " + status + ")";
  },

  /** A file the server serves behind the Bearer token, which a plain link cannot send:
   * fetched, then handed to the browser's downloads as ``name``. */
  async download(path, token, name) {
    const response = await fk.request("GET", path, token);
    const url = URL.createObjectURL(await response.blob());
    const link = fk.el("a", {href: url, download: name});
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  },

  /** A transformer job's config.json at the fused widths (the same for the fused model,
   * each round's model and the result), downloaded by a click of its own (a browser
   * holds back a second download that a page starts by itself). */
  async downloadConfig(job, token) {
    const name = `config-${job}.json`;
    await fk.download(`/v1/jobs/${encodeURIComponent(job)}/config`, token, name);
    return name;
  },

  /** One line: how a model's weights and its config.json make the model folder that
   * `fusekit` and fusekit.client download. */
  folderHint(weights, job) {
    return `put ${weights} and config-${job}.json into one folder as model.safetensors ` +
      "and config.json: that folder is the model";
  },

  /** An element with attributes (on* keys are listeners) and children (strings are text). */
  el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else if (key === "text") node.textContent = value;
      else node.setAttribute(key, value === true ? "" : value);
    }
    for (const child of children.flat(Infinity)) {
      if (child === undefined || child === null || child === false) continue;
      node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
    }
    return node;
  },

  bytes(n) {
    if (n === undefined || n === null) return "";
    const units = ["bytes", "KB", "MB", "GB", "TB"];
    let i = 0;
    let value = n;
    while (value >= 1000 && i < units.length - 1) {
      value /= 1000;
      i += 1;
    }
    return (i === 0 ? value : value.toFixed(value < 10 ? 2 : 1)) + " " + units[i];
  },

  /** "5 s ago", "3 min ago", ... from a server time (seconds since the epoch). */
  age(seconds) {
    if (!seconds) return "";
    const s = Math.max(0, Date.now() / 1000 - seconds);
    if (s < 60) return Math.round(s) + " s ago";
    if (s < 3600) return Math.round(s / 60) + " min ago";
    if (s < 86400) return (s / 3600).toFixed(1) + " h ago";
    return (s / 86400).toFixed(1) + " days ago";
  },

  when(seconds) {
    return seconds ? new Date(seconds * 1000).toLocaleString() : "";
  },

  /** Copies text, with a fallback for pages that are not a secure context. */
  async copy(text, input) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch (err) {
      if (!input) return false;
      input.select();
      return document.execCommand("copy");
    }
  },

  /** A read-only field holding a secret or link, and a button copying it. */
  copyField(text, label) {
    const input = fk.el("input", {type: "text", readonly: true, value: text, class: "copy-text",
                                  "aria-label": label});
    const button = fk.el("button", {type: "button", class: "copy", text: "Copy"});
    button.addEventListener("click", async () => {
      button.textContent = (await fk.copy(text, input)) ? "Copied" : "Select and copy";
    });
    return fk.el("span", {class: "copy-field"}, input, button);
  },
};
