"use strict";
// The client's upload page: /upload?job=<id>&client=<name>, the token typed (never in the
// link). The file is sent as it is (XMLHttpRequest streams a File from disk; the page reads
// only its safetensors header, to tell a checkpoint from a statistics file of a job that
// calibrates, and that from the targets: statistics of the client's own model), with the
// upload's progress, and the server's verdict shown in words. For a
// job that calibrates, the page also downloads the current round's model with the token
// typed, and says what the round asks for.

(() => {
  const query = new URLSearchParams(location.search);
  const job = query.get("job") || "";
  const client = query.get("client") || "";
  const $ = (id) => document.getElementById(id);
  const form = $("upload-form");
  const verdict = $("verdict");

  function say(text, kind) {
    verdict.textContent = text;
    verdict.className = kind;
  }

  function showProgress(sent, total) {
    $("progress").max = total || 1;
    $("progress").value = sent;
    const share = total ? Math.floor((100 * sent) / total) : 0;
    $("progress-text").textContent = `${fk.bytes(sent)} of ${fk.bytes(total)} (${share}%)`;
  }

  function accepted(slot, file, kind) {
    const until = kind === "checkpoint" ? "the job runs" : "the job calibrates";
    say(`Accepted: ${file.name}, ${slot.size} bytes, SHA-256 ${slot.sha256}. ` +
        `You are done; uploading again before ${until} replaces this file.`, "accepted");
  }

  /** "statistics" for a file of the job's current round (its metadata names
   * fusekit.stats of the round's model, or fusekit.cross_stats / fusekit.refit_stats),
   * "targets" for statistics of another model (the client's own), else "checkpoint": the
   * server judges the rest. */
  async function kindOf(file, token) {
    let metadata;
    try {
      const length = new DataView(await file.slice(0, 8).arrayBuffer()).getBigUint64(0, true);
      if (length > 100_000_000n) return "checkpoint";
      const header = JSON.parse(await file.slice(8, 8 + Number(length)).text());
      metadata = header.__metadata__ || {};
    } catch {
      return "checkpoint";
    }
    if (metadata["fusekit.cross_stats"] || metadata["fusekit.refit_stats"]) return "statistics";
    const stats = metadata["fusekit.stats"];
    if (stats === undefined) return "checkpoint";
    const state = await (await fk.request("GET", `/v1/jobs/${encodeURIComponent(job)}`,
                                          token)).json();
    const model = JSON.parse(stats).model;
    return state.round && state.round.model === model ? "statistics" : "targets";
  }

  async function upload(event) {
    event.preventDefault();
    const file = $("file").files[0];
    const token = $("token").value.trim();
    if (!file || !token) return;
    let kind;
    try {
      kind = await kindOf(file, token);
    } catch (err) {
      return say("Refused: " + err.message, "refused");
    }
    const xhr = new XMLHttpRequest();
    xhr.open("PUT", `/v1/jobs/${encodeURIComponent(job)}/clients/` +
                    `${encodeURIComponent(client)}/${kind}`);
    xhr.setRequestHeader("Authorization", "Bearer " + token);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.upload.addEventListener("progress", (e) => showProgress(e.loaded, e.total));
    xhr.addEventListener("load", () => {
      $("send").disabled = false;
      if (xhr.status === 201) {
        showProgress(file.size, file.size);
        accepted(JSON.parse(xhr.responseText), file, kind);
      } else { // the server may refuse before reading the body: no bar saying it was sent
        $("progress-box").hidden = true;
        say("Refused: " + fk.refusal(xhr.status, xhr.responseText), "refused");
      }
    });
    xhr.addEventListener("error", () => {
      $("send").disabled = false;
      $("progress-box").hidden = true;
      say("The connection to the server was lost during the upload; nothing was stored. " +
          "Try again.", "refused");
    });
    $("send").disabled = true;
    $("progress-box").hidden = false;
    showProgress(0, file.size);
    say(`Uploading ${file.name}...`, "");
    xhr.send(file);
  }

  if (!job || !client) {
    form.hidden = true;
    say("This link lacks the job id or the client name (…/upload?job=ID&client=NAME): " +
        "ask the coordinator for your link.", "refused");
    return;
  }
  /** The model this client can download now, if any: a calibrating job's current round's
   * model (the fused model in the first round), or the fused model of a job without
   * calibration once it has succeeded. */
  function offered(state) {
    if (state.state === "calibrating" && state.round) {
      const first = state.round.index === 1;
      return {path: "model", weights: `round-${state.round.index}-${job}.safetensors`,
              label: first ? "Download the fused model" : "Download this round's model"};
    }
    if (!state.calibrate && state.state === "succeeded") {
      return {path: "fused", weights: `fused-${job}.safetensors`,
              label: "Download the fused model"};
    }
    return null;
  }

  /** Offer the download only where it works: asked once the token is typed. */
  async function offer() {
    const token = $("token").value.trim();
    $("fetch-fused").hidden = $("fetch-config").hidden = true;
    $("offer-hint").textContent = "";
    if (!token) return;
    try {
      const state = await fk.json("GET", `/v1/jobs/${encodeURIComponent(job)}`, token);
      const model = offered(state);
      if (model) $("fetch-fused").textContent = model.label;
      $("fetch-fused").hidden = !model;
      $("offer-hint").textContent = model ? "" : `Nothing to download now: the job is ` +
        `${state.state}${state.calibrate ? "" : "; its fused model comes once it has succeeded"}.`;
    } catch (err) {
      say("Refused: " + err.message, "refused");
    }
  }

  /** That model, fetched with the token typed and handed to the browser's downloads; for
   * a calibrating job, with what the round asks for. */
  async function fetchFused() {
    const token = $("token").value.trim();
    if (!token) return say("Type your token first.", "refused");
    try {
      const state = await fk.json("GET", `/v1/jobs/${encodeURIComponent(job)}`, token);
      const model = offered(state);
      if (!model) {
        $("fetch-fused").hidden = true;
        return say(`The job is ${state.state}: there is no model to download now.`,
                   "refused");
      }
      await fk.download(`/v1/jobs/${encodeURIComponent(job)}/${model.path}`, token,
                        model.weights);
      $("fetch-config").hidden = !state.config;
      const folder = state.config ? ` (a transformer: download its config.json too, then ` +
        `${fk.folderHint(model.weights, job)})` : "";
      if (model.path === "fused") {
        return say(`The fused model is downloaded as ${model.weights}${folder}.`, "accepted");
      }
      say(`The model of ${state.round.asks} is downloaded${folder}: ` +
          "compute that on your own data (fusekit stats ...; fusekit contribute does every " +
          "round) and upload it here.", "accepted");
    } catch (err) {
      say("Refused: " + err.message, "refused");
    }
  }

  async function fetchConfig() {
    try {
      await fk.downloadConfig(job, $("token").value.trim());
    } catch (err) {
      say("Refused: " + err.message, "refused");
    }
  }

  $("target").textContent = `Checkpoint of client ${client} for job ${job}`;
  form.addEventListener("submit", upload);
  $("fetch-fused").addEventListener("click", fetchFused);
  let typing;
  $("token").addEventListener("input", () => {  // typed or pasted: ask once it settles
    clearTimeout(typing);
    typing = setTimeout(offer, 300);
  });
  $("fetch-config").addEventListener("click", fetchConfig);
})();
