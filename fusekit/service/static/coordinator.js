"use strict";
// The coordinator's page. Views by the address's fragment: "#" the jobs, "#new" a new job,
// "#job/<id>" one job. The admin token is typed once and kept in sessionStorage: for this
// tab only, gone when it closes. Every view polls the JSON API while it is shown.

(() => {
  const KEY = "fusekit.admin-token";
  const RUNNING_POLL_MS = 500;
  const POLL_MS = 2000;
  const el = fk.el;
  const main = document.getElementById("main");
  const reports = new Map(); // job id -> its report, fetched once
  let methods = null; // GET /v1/methods, fetched once
  let timer = null;
  let shown = 0; // each view has a number; a late answer for an older view is dropped

  const token = () => sessionStorage.getItem(KEY);
  const api = (method, path, body) => fk.json(method, path, token(), body);

  function show(...nodes) {
    main.replaceChildren(...nodes.filter(Boolean));
  }

  function poll(view, fn, ms) {
    clearTimeout(timer);
    timer = setTimeout(() => view === shown && fn(view), ms);
  }

  async function route() {
    clearTimeout(timer);
    shown += 1;
    document.getElementById("nav").hidden = !token();
    if (!token()) return showSignIn();
    const hash = location.hash.slice(1);
    try {
      if (hash === "new") await showCreate();
      else if (hash.startsWith("job/")) await showJob(hash.slice(4), shown);
      else await showJobs(shown);
    } catch (err) {
      failed(err);
    }
  }

  /** A wrong admin token signs out; any other refusal is shown where it happened. */
  function failed(err, where) {
    if (err.status === 401 || err.status === 403) {
      sessionStorage.removeItem(KEY);
      document.getElementById("nav").hidden = true;
      return showSignIn(err.message);
    }
    const line = el("p", {class: "error", role: "alert", text: err.message});
    if (where) where.replaceChildren(line);
    else show(line);
  }

  // -- signing in ----------------------------------------------------------------------

  function showSignIn(message) {
    const input = el("input", {type: "password", id: "admin-token", autocomplete: "off",
                               required: true});
    const form = el("form", {id: "sign-in"},
      el("label", {}, "Admin token ", input),
      el("button", {type: "submit", text: "Sign in"}));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const typed = input.value.trim();
      try {
        await fk.json("GET", "/v1/jobs", typed); // the admin token, or a refusal
        sessionStorage.setItem(KEY, typed);
        route();
      } catch (err) {
        showSignIn(err.message);
      }
    });
    show(el("section", {class: "card"},
      el("h2", {text: "Sign in"}),
      el("p", {class: "hint", text: "The admin token is in admin.token in the server's data " +
        "folder (or FUSEKIT_ADMIN_TOKEN). It is kept for this browser tab only."}),
      form,
      message && el("p", {class: "error", role: "alert", id: "sign-in-error", text: message})));
    input.focus();
  }

  // -- the jobs --------------------------------------------------------------------------

  async function showJobs(view) {
    const {jobs} = await api("GET", "/v1/jobs");
    if (view !== shown) return;
    const rows = jobs.map((job) => el("tr", {"data-job": job.id},
      el("td", {}, el("a", {href: `#job/${job.id}`, title: job.id, text: job.id.slice(0, 8)})),
      el("td", {text: job.method}),
      el("td", {}, badge(job.state)),
      el("td", {class: "num", text: `${job.filled} of ${job.clients}`}),
      el("td", {text: job.state === "calibrating" ?
        `statistics: ${job.statistics} of ${job.clients}` : job.progress || ""}),
      el("td", {title: fk.when(job.created_at), text: fk.age(job.created_at)})));
    show(el("section", {class: "card"},
      el("h2", {}, "Jobs ", el("a", {href: "#new", class: "button", text: "New job"})),
      jobs.length === 0 ? el("p", {class: "hint", text: "No jobs yet."}) :
        el("table", {id: "jobs"},
          el("thead", {}, el("tr", {}, ["job", "method", "state", "slots filled",
                                        "progress", "created"].map((h) => el("th", {text: h})))),
          el("tbody", {}, rows))));
    poll(view, (v) => showJobs(v).catch(failed), POLL_MS);
  }

  function badge(state) {
    return el("span", {class: `state ${state}`, text: state});
  }

  // -- a new job -------------------------------------------------------------------------

  async function showCreate() {
    methods = methods || (await api("GET", "/v1/methods")).methods;
    const method = el("select", {id: "method", name: "method"},
      methods.map((m) => el("option", {value: m.name, text: `${m.name}: ${m.summary}`})));
    method.value = methods.some((m) => m.name === "pfnm") ? "pfnm" : methods[0].name;
    const fields = el("fieldset", {id: "params"});
    const drawParams = () => fields.replaceChildren(
      el("legend", {text: "Parameters (empty: the default)"}),
      ...methods.find((m) => m.name === method.value).params.map(paramField));
    method.addEventListener("change", drawParams);
    drawParams();
    const clients = el("textarea", {id: "clients", rows: 3, required: true,
                                    placeholder: "hospital-a, hospital-b, hospital-c"});
    const limit = el("input", {type: "text", id: "max-bytes", inputmode: "numeric",
                               placeholder: "the server's limit"});
    const autoRun = el("input", {type: "checkbox", id: "auto-run"});
    const calibrate = el("input", {type: "checkbox", id: "calibrate"});
    const protocol = el("select", {id: "protocol"},
      ["one-pass", "layerwise", "align"].map((name) => el("option", {value: name, text: name})));
    const inputMoments = el("input", {type: "checkbox", id: "input-moments"});
    const error = el("div", {id: "create-error"});
    const form = el("form", {id: "create", novalidate: true},
      el("label", {}, "Method ", method),
      el("label", {}, "Clients (one name each, separated by commas or lines) ", clients),
      el("label", {}, "Upload limit in bytes ", limit),
      el("label", {class: "inline"}, autoRun, " Run as soon as the last checkpoint arrives"),
      el("label", {class: "inline"}, calibrate, " Calibrate the fused model with statistics " +
         "the clients compute of it on their own data"),
      el("label", {}, "Calibration rounds: one-pass (one round), layerwise (one per " +
         "calibrated layer: exact), align (calibration, alignment, one refit round per " +
         "layer) ", protocol),
      el("label", {class: "inline"}, inputMoments, " Layerwise: the first layer from the " +
         "clients' input moments, without a round"),
      fields, error,
      el("button", {type: "submit", text: "Create the job"}));
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      const body = {method: method.value, clients: clients.value.split(/[\s,]+/).filter(Boolean),
                    params: readParams(fields), auto_run: autoRun.checked,
                    calibrate: calibrate.checked, protocol: protocol.value,
                    input_moments: inputMoments.checked};
      if (limit.value.trim()) body.max_checkpoint_bytes = number(limit.value.trim());
      try {
        const created = await api("POST", "/v1/jobs", body);
        showTokens(created);
      } catch (err) {
        failed(err, error);
      }
    });
    show(el("section", {class: "card"}, el("h2", {text: "New job"}), form));
  }

  /** One parameter's input, built from its declaration (GET /v1/methods). */
  function paramField(spec) {
    const id = `param-${spec.name}`;
    let input;
    if (spec.kind === "bool" && !spec.optional) {
      input = el("input", {type: "checkbox", id, checked: spec.default === true});
    } else if (spec.kind === "bool" || (spec.kind === "str" && spec.choices)) {
      const options = spec.kind === "bool" ? ["on", "off"] : spec.choices;
      input = el("select", {id},
        el("option", {value: "", text: `default (${spec.default_text})`}),
        options.map((o) => el("option", {value: o, text: o})));
    } else {
      input = el("input", {type: "text", id, placeholder: spec.default_text,
                           list: spec.choices ? `${id}-words` : null});
    }
    input.dataset.param = spec.name;
    input.dataset.kind = spec.kind;
    input.dataset.default = String(spec.default);
    const words = spec.choices && spec.kind !== "str" &&
      el("datalist", {id: `${id}-words`}, spec.choices.map((c) => el("option", {value: c})));
    return el("div", {class: "param"},
      el("label", {for: id}, el("code", {text: spec.name})),
      input, words || "",
      el("span", {class: "hint", text: `${spec.help}. Takes ${spec.expected}; default ` +
        `${spec.default_text}.` + (spec.paper ? ` (${spec.paper})` : "")}));
  }

  /** The parameters given (unset ones are left to the method's defaults). */
  function readParams(fields) {
    const params = {};
    for (const input of fields.querySelectorAll("[data-param]")) {
      const {param, kind} = input.dataset;
      if (input.type === "checkbox") {
        if (String(input.checked) !== input.dataset.default) params[param] = input.checked;
      } else if (input.value.trim() !== "") {
        params[param] = value(kind, input.value.trim());
      }
    }
    return params;
  }

  /** Numbers as numbers, lists as lists; anything else as typed, for the server to judge
   * (its refusal names the parameter and what it takes). */
  function value(kind, text) {
    if (kind === "bool") return text === "on";
    if (kind === "int" || kind === "float") return number(text);
    if (kind === "floats" || kind === "ints") {
      const parts = text.split(",").map((part) => number(part.trim()));
      if (parts.some((part) => typeof part !== "number")) return text;
      return parts.length === 1 ? parts[0] : parts;
    }
    return text;
  }

  function number(text) {
    const n = Number(text);
    return text !== "" && Number.isFinite(n) ? n : text;
  }

  function uploadLink(jobId, client) {
    return `${location.origin}/upload?job=${jobId}&client=${encodeURIComponent(client)}`;
  }

  function showTokens(created) {
    const rows = Object.entries(created.tokens).map(([client, secret]) => el("tr", {},
      el("td", {text: client}),
      el("td", {}, fk.copyField(secret, `token of ${client}`)),
      el("td", {}, fk.copyField(uploadLink(created.id, client), `upload link of ${client}`))));
    show(el("section", {class: "card"},
      el("h2", {text: `Job ${created.id} created`}),
      el("p", {class: "warning", text: "Each client's token is shown only now: the server " +
        "keeps only its hash. Send each client its upload link and, separately and " +
        "privately, its token (the link does not hold it)."}),
      el("table", {id: "tokens"},
        el("thead", {}, el("tr", {}, ["client", "token", "upload link"].map(
          (h) => el("th", {text: h})))),
        el("tbody", {}, rows)),
      el("p", {}, el("a", {href: `#job/${created.id}`, class: "button", id: "open-job",
                           text: "Open the job"}))));
  }

  // -- one job ---------------------------------------------------------------------------

  async function showJob(id, view) {
    const job = await api("GET", `/v1/jobs/${encodeURIComponent(id)}`);
    if (view !== shown) return;
    if (job.state === "succeeded" && !reports.has(id)) {
      reports.set(id, await api("GET", `/v1/jobs/${id}/report`));
    }
    const actionError = el("div", {id: "action-error"});
    show(el("section", {class: "card", id: "job", "data-state": job.state},
      el("h2", {}, `Job ${job.id} `, badge(job.state)),
      facts(job),
      progress(job),
      job.error && el("p", {class: "error", id: "job-error", text: job.error}),
      actions(job, actionError), actionError,
      el("h3", {text: "Checkpoints"}),
      slots(job, "slots", "checkpoint"),
      job.calibrate && el("h3", {text: job.round ? `Statistics: ${job.round.asks}` :
                                                   "Statistics of the fused model"}),
      job.calibrate && slots(job, "statistics", "statistics"),
      job.calibrate && el("h3", {text: "Targets: statistics of each client's own model"}),
      job.calibrate && slots(job, "targets", "targets")),
      reports.has(id) && el("section", {class: "card", id: "report"},
        el("h3", {text: "Report"}), reportView(reports.get(id))));
    if (!["succeeded", "failed", "cancelled"].includes(job.state)) {
      const waitsOnClients = ["collecting", "calibrating"].includes(job.state);
      const ms = waitsOnClients ? POLL_MS : RUNNING_POLL_MS;
      poll(view, (v) => showJob(id, v).catch(failed), ms);
    }
  }

  function facts(job) {
    const rows = [
      ["method", job.method],
      ["parameters", Object.keys(job.params).length ? JSON.stringify(job.params) : "defaults"],
      ["upload limit", fk.bytes(job.max_checkpoint_bytes)],
      ["runs when full", job.auto_run ? "yes" : "no (Run below)"],
      ["calibrates", job.calibrate ? `yes (${job.protocol}): with each client's statistics, ` +
        "each round once all are in or on Calibrate now" : ""],
      ["round", job.state === "calibrating" && job.round ? job.round.asks : ""],
      ["fused", job.fused ? `${fk.when(job.fused.fused_at)}: ${fk.bytes(job.fused.size)}, ` +
        `SHA-256 ${job.fused.sha256}` : ""],
      ["created", fk.when(job.created_at)],
      ["queued", fk.when(job.queued_at)],
      ["started", fk.when(job.started_at)],
      ["finished", fk.when(job.finished_at)],
      ["attempts", String(job.attempts)],
    ].filter(([, v]) => v);
    return el("dl", {class: "facts"}, rows.map(([k, v]) => [el("dt", {text: k}),
                                                             el("dd", {text: v})]));
  }

  /** "fusing: layer i of L matched" as a bar; other stages as words. */
  function progress(job) {
    if (!job.progress) return "";
    const layer = /layer (\d+) of (\d+)/.exec(job.progress);
    return el("div", {id: "progress-box"},
      layer && el("progress", {id: "job-progress", max: layer[2], value: layer[1]}),
      el("span", {id: "progress-text", text: job.progress}));
  }

  function actions(job, errorBox) {
    const filled = Object.values(job.slots).every((slot) => slot.filled);
    const some = (kind) => Object.values(job[kind] || {}).some((slot) => slot.filled);
    const needsTargets = job.fused && job.fused.needs_targets && !some("targets");
    const received = some("statistics") && !needsTargets;
    const act = (fn) => async () => {
      try {
        await fn();
      } catch (err) {
        failed(err, errorBox);
      }
    };
    return el("p", {class: "actions"},
      el("button", {type: "button", id: "run", disabled: job.state !== "collecting" || !filled,
                    title: filled ? "" : "every client must have uploaded first", text: "Run",
                    onclick: act(async () => {
                      await api("POST", `/v1/jobs/${job.id}/run`);
                      route();
                    })}),
      job.calibrate && el("button", {
        type: "button", id: "calibrate-now",
        disabled: job.state !== "calibrating" || !received,
        title: received ? "" : "at least one client's statistics must have arrived" +
          (needsTargets ? ", and one client's targets (the model has no BatchNorm)" : ""),
        text: job.round && job.round.total > 1 ? "Finish this round now" : "Calibrate now",
        onclick: act(async () => {
          await api("POST", `/v1/jobs/${job.id}/calibrate`);
          route();
        })}),
      el("button", {type: "button", id: "download", disabled: job.state !== "succeeded",
                    text: job.calibrate ? "Download the calibrated model" :
                      "Download the fused model",
                    onclick: act(() => download(job, "result",
                                                job.calibrate ? "calibrated" : "fused"))}),
      job.calibrate && el("button", {
        type: "button", id: "download-fused", disabled: !job.fused,
        text: "Download the fused model (before calibration)",
        onclick: act(() => download(job, "fused", "fused"))}),
      job.config && el("button", {
        type: "button", id: "download-config", disabled: !job.fused,
        text: "Download its config.json (a transformer's, at the fused widths)",
        title: fk.folderHint("the model's .safetensors", job.id),
        onclick: act(() => fk.downloadConfig(job.id, token()))}),
      el("button", {type: "button", id: "delete", class: "danger", text: "Delete",
                    onclick: act(async () => {
                      if (!confirm(`Delete job ${job.id} with its checkpoints and result?`)) {
                        return;
                      }
                      await api("DELETE", `/v1/jobs/${job.id}`);
                      reports.delete(job.id);
                      location.hash = "";
                    })}));
  }

  /** The result (or the fused model) needs the Bearer token, which a plain link cannot
   * send: fetched, then handed to the browser's downloads as a file. */
  async function download(job, which, name) {
    await fk.download(`/v1/jobs/${job.id}/${which}`, token(), `${name}-${job.id}.safetensors`);
  }

  /** The job's states in which clients upload into slots of each kind. */
  const UPLOADS_WHILE = {slots: ["collecting"], statistics: ["calibrating"],
                         targets: ["collecting", "calibrating"]};

  /** The clients' slots of one kind: "slots" (checkpoints), "statistics" or "targets". */
  function slots(job, kind, what) {
    const rows = Object.entries(job[kind]).map(([client, slot]) => el("tr",
      {"data-client": client, class: slot.filled ? "filled" : "waiting"},
      el("td", {class: "name", text: client}),
      el("td", {text: slot.filled ? "received" : "waiting"}),
      el("td", {class: "num", text: slot.filled ? fk.bytes(slot.size) : ""}),
      el("td", {}, slot.filled ? el("code", {class: "sha", text: slot.sha256}) : ""),
      el("td", {title: fk.when(slot.uploaded_at), text: fk.age(slot.uploaded_at)}),
      el("td", {}, UPLOADS_WHILE[kind].includes(job.state) ?
        fk.copyField(uploadLink(job.id, client), `upload link of ${client}`) : "")));
    return el("table", {id: kind},
      el("thead", {}, el("tr", {}, ["client", what, "size", "SHA-256", "when",
                                    "upload link"].map((h) => el("th", {text: h})))),
      el("tbody", {}, rows));
  }

  // -- the report, drawn ------------------------------------------------------------------

  function reportView(report) {
    const time = Number.isFinite(report.time_s) ? `${report.time_s.toFixed(2)} s` : "";
    const layers = (report.report && Array.isArray(report.report.layers)) ?
      report.report.layers : [];
    const calibration = report.calibration;
    return el("div", {},
      el("p", {}, `${report.method}: fused hidden widths ${JSON.stringify(report.widths)}` +
                  (time ? `, fused in ${time}` : "")),
      calibration && el("p", {id: "calibration"}, calibrated(calibration)),
      el("div", {class: "charts"}, charts(layers)),
      el("details", {}, el("summary", {text: "The whole report (JSON)"}),
         el("pre", {text: JSON.stringify(report, null, 1)})));
  }

  /** One line: how the result was calibrated, in one pass or in rounds. */
  function calibrated(calibration) {
    const targets = (calibration.targets_from || []).length ?
      `; targets of ${calibration.targets_from.join(", ")}` : "";
    if (calibration.rounds) {
      return `Calibrated (${calibration.protocol}) in ${calibration.rounds.length} rounds: ` +
        calibration.rounds.map((r) => `${r.kind}${r.layer ? " " + r.layer : ""} from ` +
          `${r.statistics_from.length ? r.statistics_from.join(", ") : "the targets"}`)
          .join("; ") + targets;
    }
    return `Calibrated (${calibration.protocol}) ` +
      `with the statistics of ${calibration.statistics_from.join(", ")}: ` +
      `${calibration.samples} inputs, ${calibration.mode} mode` +
      (calibration.missing.length ? `; none from ${calibration.missing.join(", ")}` : "") +
      targets;
  }

  function charts(layers) {
    if (layers.length === 0) return [];
    const names = layers.map((layer) => `layer ${layer.layer}`);
    const series = (name, key) => ({name, values: layers.map((layer) => layer[key])});
    const present = (s) => s.values.some(Number.isFinite);
    const out = [];
    const widths = [series("asked", "width_asked"), series("inferred", "inferred_width"),
                    series("fused", "width")].filter(present);
    if (widths.length) {
      out.push(fkCharts.bars("Fused width per layer", "neurons", names, widths));
    }
    const objectives = layers.filter((layer) => Array.isArray(layer.objective) &&
                                                layer.objective.length)
      .map((layer) => ({name: `layer ${layer.layer}`, values: layer.objective}));
    if (objectives.length) {
      out.push(fkCharts.lines("Objective per sweep", "objective", "sweep", objectives));
    }
    const timeKeys = [...new Set(layers.flatMap(Object.keys))]
      .filter((key) => /^time_.*_s$/.test(key));
    const times = timeKeys.map((key) => series(key.slice(5, -2), key)).filter(present);
    if (times.length) out.push(fkCharts.bars("Matching time per layer", "seconds", names, times));
    return out;
  }

  document.getElementById("sign-out").addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.hash = "";
    route();
  });
  window.addEventListener("hashchange", route);
  route();
})();
