// The playground: a chat over /v1/chat/completions, streamed, with logprobs for the token view.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} of the chat so far, the system prompt apart
const attachments = [];  // data: URLs of the images the next message carries
let modelName = null;
let controller = null;  // the reply in flight, if any

async function loadModel() {
  modelName = await pickModel($("model"), (id) => { modelName = id; });
}

function addMessage(role, text, images = []) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = '<div class="role"></div><div class="images"></div><div class="content"></div><div class="stats"></div>';
  div.querySelector(".role").textContent = role;
  for (const url of images) {
    const img = document.createElement("img");
    img.src = url;
    div.querySelector(".images").appendChild(img);
  }
  div.querySelector(".content").textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Green for likely tokens, red for unlikely ones.
function colourOf(logprob) {
  const p = Math.exp(logprob);
  return `hsl(${Math.round(120 * p)}, 75%, 82%)`;
}

function tokenSpan(entry) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = entry.token.replace(/\n/g, "\u21b5\n");  // a line break shows as ↵, so it can be hovered
  span.style.background = colourOf(entry.logprob);
  span.dataset.entry = JSON.stringify(entry);
  return span;
}

function showTooltip(event) {
  const span = event.target.closest(".tok");
  const tip = $("tooltip");
  if (!span) {
    tip.style.display = "none";
    return;
  }
  const entry = JSON.parse(span.dataset.entry);
  const rows = entry.top_logprobs.length ? entry.top_logprobs : [{ token: entry.token, logprob: entry.logprob }];
  tip.innerHTML = "<table></table>";
  const table = tip.querySelector("table");
  for (const alt of rows) {
    const tr = table.insertRow();
    if (alt.token === entry.token) tr.className = "chosen";
    tr.insertCell().textContent = JSON.stringify(alt.token);
    const p = tr.insertCell();
    p.className = "p";
    p.textContent = `${(100 * Math.exp(alt.logprob)).toFixed(1)}%`;
  }
  tip.style.display = "block";
  tip.style.left = `${Math.min(event.clientX + 12, window.innerWidth - tip.offsetWidth - 8)}px`;
  tip.style.top = `${event.clientY + 16}px`;
}

// The request body from the settings; throws Error with a message for the page on bad input.
function requestBody(messages) {
  const body = {
    model: modelName, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value), logprobs: true, top_logprobs: 5,
  };
  if ($("seed").value !== "") body.seed = Number($("seed").value);
  if ($("ignore-eos").checked) body.ignore_eos = true;
  const schema = $("json-schema").value.trim();
  $("schema-error").textContent = "";
  if (schema) {
    try {
      body.response_format = { type: "json_schema", json_schema: { name: "playground", schema: JSON.parse(schema) } };
    } catch (e) {
      $("schema-error").textContent = `Not JSON: ${e.message}`;
      throw new Error("the JSON schema is not valid JSON");
    }
  }
  return body;
}

function renderStats(div, reply) {
  const parts = [];
  if (reply.firstAt !== null) parts.push(`first token ${Math.round(reply.firstAt - reply.sentAt)} ms`);
  const tokens = reply.usage ? reply.usage.completion_tokens : reply.tokens;
  if (reply.firstAt !== null && reply.lastAt > reply.firstAt && tokens > 1) {
    parts.push(`${formatNumber((tokens - 1) / ((reply.lastAt - reply.firstAt) / 1000))} tok/s`);
  }
  parts.push(`${tokens} tokens`);
  if (reply.usage) {
    const cached = reply.usage.prompt_tokens_details ? reply.usage.prompt_tokens_details.cached_tokens : 0;
    const prompt = reply.usage.prompt_tokens;
    parts.push(`prefix cache ${cached}/${prompt} prompt tokens (${formatNumber(prompt ? 100 * cached / prompt : 0, 0)}%)`);
  }
  const stats = div.querySelector(".stats");
  stats.textContent = parts.join(" · ");
  if (reply.finish) {
    const end = document.createElement("span");
    end.className = reply.finish === "stopped" ? "stopped" : "";
    end.textContent = ` · ${reply.finish}`;
    stats.appendChild(end);
  }
}

// The attached images, as thumbnails above the composer (each can be taken off again).
function renderAttachments() {
  const strip = $("attachments");
  strip.innerHTML = "";
  strip.hidden = attachments.length === 0;
  attachments.forEach((url, i) => {
    const thumb = document.createElement("div");
    thumb.className = "thumb";
    thumb.innerHTML = '<img alt="attached image"><button class="secondary" title="Remove">×</button>';
    thumb.querySelector("img").src = url;
    thumb.querySelector("button").onclick = () => { attachments.splice(i, 1); renderAttachments(); };
    strip.appendChild(thumb);
  });
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// A user message's content: its text, or with images OpenAI's parts (the images first, then the text).
function userContent(text, images) {
  if (!images.length) return text;
  return [...images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text }];
}

async function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  const system = $("system").value.trim();
  const images = attachments.splice(0);
  const content = userContent(text, images);
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation, { role: "user", content }];
  let body;
  try {
    body = requestBody(messages);
  } catch {
    attachments.push(...images);
    return;
  }
  $("input").value = "";
  renderAttachments();
  conversation.push({ role: "user", content });
  addMessage("user", text, images);
  const div = addMessage("assistant", "");
  const output = div.querySelector(".content");
  const reply = { sentAt: performance.now(), firstAt: null, lastAt: null, tokens: 0, text: "", usage: null, finish: null };
  controller = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      output.textContent = await errorText(response);
      output.classList.add("error");
      return;
    }
    await readEvents(response, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) reply.usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const now = performance.now();
        const delta = choice.delta.content || "";
        const entries = (choice.logprobs && choice.logprobs.content) || [];
        if (delta || entries.length) {
          if (reply.firstAt === null) reply.firstAt = now;
          reply.lastAt = now;
        }
        reply.text += delta;
        reply.tokens += entries.length;
        if ($("token-view").checked && entries.length) {
          for (const entry of entries) output.appendChild(tokenSpan(entry));
        } else if (delta) {
          output.appendChild(document.createTextNode(delta));
        }
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      renderStats(div, reply);
      div.scrollIntoView({ block: "end" });
    });
  } catch (e) {
    if (e.name === "AbortError") {
      reply.finish = "stopped";
    } else {
      const error = document.createElement("div");
      error.className = "error";
      error.textContent = e.message;
      div.appendChild(error);
    }
  } finally {
    renderStats(div, reply);
    if (reply.text) conversation.push({ role: "assistant", content: reply.text });
    controller = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    div.dataset.done = "true";
  }
}

$("send").onclick = send;
$("attach").onclick = () => $("attach-file").click();
$("attach-file").addEventListener("change", async (event) => {
  for (const file of event.target.files) attachments.push(await readAsDataURL(file));
  event.target.value = "";
  renderAttachments();
});
$("stop").onclick = () => controller && controller.abort();
$("input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    send();
  }
});
$("clear").onclick = () => {
  if (controller) controller.abort();
  conversation.length = 0;
  attachments.length = 0;
  renderAttachments();
  $("messages").innerHTML = "";
};
$("messages").addEventListener("mousemove", showTooltip);
$("messages").addEventListener("mouseleave", () => { $("tooltip").style.display = "none"; });
loadModel();
