"use strict";
// The client's upload page: /upload?job=<id>&client=<name>, the token typed (never in the
// link). The file is sent as it is (XMLHttpRequest streams a File from disk; the page never
// reads it), with the upload's progress, and the server's verdict shown in words.

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

  function accepted(slot, file) {
    say(`Accepted: ${file.name}, ${slot.size} bytes, SHA-256 ${slot.sha256}. ` +
        "You are done; uploading again before the job runs replaces this file.", "accepted");
  }

  function upload(event) {
    event.preventDefault();
    const file = $("file").files[0];
    const token = $("token").value.trim();
    if (!file || !token) return;
    const xhr = new XMLHttpRequest();
    xhr.open("PUT", `/v1/jobs/${encodeURIComponent(job)}/clients/` +
                    `${encodeURIComponent(client)}/checkpoint`);
    xhr.setRequestHeader("Authorization", "Bearer " + token);
    xhr.setRequestHeader("Content-Type", "application/octet-stream");
    xhr.upload.addEventListener("progress", (e) => showProgress(e.loaded, e.total));
    xhr.addEventListener("load", () => {
      $("send").disabled = false;
      if (xhr.status === 201) {
        showProgress(file.size, file.size);
        accepted(JSON.parse(xhr.responseText), file);
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
  $("target").textContent = `Checkpoint of client ${client} for job ${job}`;
  form.addEventListener("submit", upload);
})();
