// What both pages share: the API key (asked for when the server answers 401, kept in this
// browser's localStorage), fetch with it, and reading a server-sent-events body.
"use strict";

const KEY_STORE = "dabba-api-key";

function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

function authHeaders(extra = {}) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

// The key dialog, added to the page the first time a key is wanted.
function keyDialog() {
  let dialog = document.getElementById("api-key-dialog");
  if (dialog) return dialog;
  dialog = document.createElement("dialog");
  dialog.id = "api-key-dialog";
  dialog.innerHTML = '<form method="dialog"><p id="api-key-message"></p>'
    + '<input id="api-key" type="password" autocomplete="off" placeholder="API key">'
    + '<div class="buttons"><button id="api-key-save" type="submit">Save</button></div></form>';
  document.body.appendChild(dialog);
  return dialog;
}

// Resolves once the user saved a key in the key dialog.
function askForKey(message) {
  const dialog = keyDialog();
  const input = document.getElementById("api-key");
  document.getElementById("api-key-message").textContent = message;
  input.value = apiKey();
  return new Promise((resolve) => {
    const form = dialog.querySelector("form");
    form.onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_STORE, input.value.trim());
      dialog.close();
      resolve();
    };
    dialog.showModal();
    input.focus();
  });
}

// fetch() with the key; on 401 asks for a key and tries again.
async function apiFetch(path, options = {}) {
  for (;;) {
    const response = await fetch(path, { ...options, headers: authHeaders(options.headers || {}) });
    if (response.status !== 401) return response;
    await askForKey(apiKey() ? "The server refused this key. Enter the server's API key:"
                             : "This server wants an API key (dabba serve --api-key):");
  }
}

// The message of an OpenAI-style error body, else the status.
async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch {
    return `HTTP ${response.status}`;
  }
}

// Calls onEvent(data) for each "data:" event of an SSE body until it ends (or the fetch aborts).
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) onEvent(data.join("\n"));
    }
  }
}

function formatNumber(x, digits = 1) {
  return Number.isFinite(x) ? x.toFixed(digits) : "–";
}

// The model to talk to or watch: from /v1/models (a server of several lists each with its state;
// an adapter names its parent), ?model= in the page's address first, else the first loaded. With a
// choice, a <select> in ``holder`` calls onChange(id); else ``holder`` shows the one name.
async function pickModel(holder, onChange, basesOnly = false) {
  const response = await apiFetch("/v1/models");
  if (!response.ok) {
    holder.textContent = await errorText(response);
    return null;
  }
  const models = (await response.json()).data.filter((m) => !(basesOnly && m.parent));
  const wanted = new URLSearchParams(location.search).get("model");
  const chosen = models.find((m) => m.id === wanted) || models.find((m) => !m.state || m.state === "loaded")
    || models[0];
  if (models.length < 2) {
    holder.textContent = chosen.id;
    return chosen.id;
  }
  const select = document.createElement("select");
  for (const m of models) select.add(new Option(m.state ? `${m.id} (${m.state})` : m.id, m.id));
  select.value = chosen.id;
  select.addEventListener("change", () => onChange(select.value));
  holder.replaceChildren(select);
  return chosen.id;
}
