// bmoe's chat page: a conversation streamed from this server's /v1/chat/completions, and a live
// panel fed by /v1/bmoe/events. Plain browser JavaScript: fetch streams (not EventSource, which
// cannot send the API key as a header), no framework, nothing loaded from elsewhere.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = { key: "bmoe.apiKey", settings: "bmoe.settings" };
  const SAMPLING = ["temperature", "top_p", "top_k", "max_tokens", "seed"];
  const INTEGERS = new Set(["top_k", "max_tokens", "seed"]);

  let history = []; // the conversation as the API takes it
  let running = null; // {controller, view} while an answer streams
  let watching = null; // the events stream's AbortController
  let lastAnswer = null; // the last `generation` event

  // ---- the server's streams -----------------------------------------------------------------------

  /** Server-sent events from a fetch Response: yields {event, data} per event (comments skipped). */
  async function* sseEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = "message";
        const data = [];
        for (const line of block.split("\n")) {
          if (line === "" || line.startsWith(":")) continue;
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          let value = colon < 0 ? "" : line.slice(colon + 1);
          if (value.startsWith(" ")) value = value.slice(1);
          if (field === "event") event = value;
          else if (field === "data") data.push(value);
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  }

  function headers() {
    const h = { "Content-Type": "application/json" };
    const key = localStorage.getItem(STORE.key);
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (_) {
      return `HTTP ${response.status}`;
    }
  }

  function needKey(message) {
    $("settings").open = true;
    $("settings").classList.add("needs-key");
    $("api_key").classList.add("needs-key");
    $("api_key").title = message;
  }

  // ---- the conversation ---------------------------------------------------------------------------

  function addMessage(role, text) {
    const el = document.createElement("div");
    el.className = "msg " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text || "";
    el.append(label, content);
    $("conversation").append(el);
    el.scrollIntoView({ block: "end" });
    return { el, content };
  }

  /** An assistant answer being streamed: content, reasoning (folded) and tool calls as they come. */
  class AnswerView {
    constructor() {
      const { el, content } = addMessage("assistant");
      this.el = el;
      this.contentEl = content;
      this.content = "";
      this.reasoning = "";
      this.calls = []; // [{id, type, function: {name, arguments}}] by index
      this.tokens = 0;
      el.classList.add("streaming");
      el.dataset.state = "streaming";
    }

    delta(d) {
      if (d.reasoning_content) {
        if (!this.reasoningEl) {
          const box = document.createElement("details");
          box.className = "reasoning";
          const summary = document.createElement("summary");
          summary.textContent = "reasoning";
          this.reasoningEl = document.createElement("div");
          this.reasoningEl.className = "text";
          box.append(summary, this.reasoningEl);
          this.el.insertBefore(box, this.contentEl);
        }
        this.reasoning += d.reasoning_content;
        this.reasoningEl.textContent = this.reasoning;
      }
      if (d.content) {
        this.content += d.content;
        this.contentEl.textContent = this.content;
      }
      for (const call of d.tool_calls || []) {
        const i = call.index || 0;
        const have = this.calls[i] || (this.calls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
        if (call.id) have.id = call.id;
        if (call.function && call.function.name) have.function.name += call.function.name;
        if (call.function && call.function.arguments) have.function.arguments += call.function.arguments;
        this.showCalls();
      }
    }

    showCalls() {
      for (const el of this.el.querySelectorAll(".tool")) el.remove();
      for (const call of this.calls) {
        const el = document.createElement("div");
        el.className = "tool";
        el.textContent = `tool call ${call.function.name}(${call.function.arguments})`;
        this.el.insertBefore(el, this.metaEl || null);
      }
    }

    token(step) {
      this.tokens = step;
      this.el.dataset.tokens = String(step);
    }

    finish(reason, bmoe) {
      this.el.dataset.finish = reason;
      if (!bmoe) return;
      for (const k of ["cache_hit_pct", "mib_per_token", "tok_s", "completion_tokens"]) this.el.dataset[k] = String(bmoe[k]);
      this.meta([`${bmoe.completion_tokens} tokens`, `${fixed(bmoe.tok_s, 1)} tok/s`, `${hitText(bmoe.cache_hit_pct)} hit`,
        `${fixed(bmoe.mib_per_token, 2)} MiB/token`, reason]);
    }

    meta(parts) {
      if (!this.metaEl) {
        this.metaEl = document.createElement("div");
        this.metaEl.className = "meta";
        this.el.append(this.metaEl);
      }
      this.metaEl.textContent = parts.join(" · ");
    }

    error(message) {
      const el = document.createElement("div");
      el.className = "error";
      el.textContent = message;
      this.el.append(el);
      this.el.dataset.state = "error";
    }

    end(state) {
      this.el.classList.remove("streaming");
      if (this.el.dataset.state === "streaming") this.el.dataset.state = state;
      if (state === "stopped") this.meta([`stopped after ${this.tokens} tokens`]);
    }

    turn() {
      const m = { role: "assistant", content: this.content };
      if (this.reasoning) m.reasoning_content = this.reasoning;
      if (this.calls.length) {
        m.tool_calls = this.calls;
        m.content = this.content || null;
      }
      return m;
    }
  }

  function sampling() {
    const out = {};
    for (const name of SAMPLING) {
      const text = $(name).value.trim();
      if (text !== "") out[name] = INTEGERS.has(name) ? parseInt(text, 10) : parseFloat(text);
    }
    return out;
  }

  async function send(text) {
    const userView = addMessage("user", text);
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push(...history, { role: "user", content: text });
    const view = new AnswerView();
    const controller = new AbortController();
    running = { controller, view };
    setBusy(true);
    let stopped = false;
    try {
      const response = await fetch("/v1/chat/completions", {
        method: "POST", headers: headers(), signal: controller.signal,
        body: JSON.stringify({ model: "bmoe", messages, stream: true, ...sampling() }),
      });
      if (!response.ok) {
        const message = await errorText(response);
        if (response.status === 401) needKey(message);
        view.error(message);
        userView.el.dataset.state = "not sent";
        $("prompt").value = text;
        return;
      }
      history.push({ role: "user", content: text });
      for await (const ev of sseEvents(response)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) {
          view.error(chunk.error.message);
          break;
        }
        const choice = (chunk.choices || [])[0];
        if (!choice) continue;
        if (choice.delta) view.delta(choice.delta);
        if (chunk.bmoe && chunk.bmoe.step) view.token(chunk.bmoe.step);
        if (choice.finish_reason) view.finish(choice.finish_reason, chunk.bmoe);
      }
      history.push(view.turn());
    } catch (e) {
      if (e.name !== "AbortError") view.error(String(e));
      else {
        stopped = true;
        if (history.length && history[history.length - 1].role === "user") history.push(view.turn());
      }
    } finally {
      view.end(stopped ? "stopped" : "done");
      running = null;
      setBusy(false);
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
  }

  // ---- the live panel -----------------------------------------------------------------------------

  function fixed(x, digits) {
    return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "–";
  }

  function hitText(pct) {
    return pct < 0 ? "no cache" : fixed(pct, 1) + "%";
  }

  function mib(x) {
    return x >= 1024 ? fixed(x / 1024, 2) + " GiB" : fixed(x, 1) + " MiB";
  }

  /** The four figures: of the answer streaming now, or of the last one that ended. */
  function showFigures(f, source, caption) {
    const show = (id, text, value) => {
      $(id).textContent = text;
      $(id).dataset.value = String(value);
    };
    show("tok_s", fixed(f.tok_s, 1), f.tok_s);
    show("cache_hit_pct", f.cache_hit_pct < 0 ? "–" : fixed(f.cache_hit_pct, 1), f.cache_hit_pct);
    show("mib_per_token", fixed(f.mib_per_token, 2), f.mib_per_token);
    show("flash_mib_s", fixed(f.flash_mib_s, 0), f.flash_mib_s);
    $("panel").dataset.source = source;
    $("figures_of").textContent = caption;
  }

  function onGeneration(g) {
    lastAnswer = g;
    const panel = $("panel");
    panel.dataset.generations = String(Number(panel.dataset.generations || 0) + 1);
    showFigures(g, "answer", `last answer: ${g.completion_tokens} tokens, ${g.finish_reason}` +
      (g.cache_hit_pct < 0 ? ", no cache" : ""));
  }

  function onSnapshot(s) {
    const panel = $("panel");
    panel.dataset.snapshots = String(Number(panel.dataset.snapshots || 0) + 1);
    $("model").textContent = s.model;
    $("state").textContent = s.generating ? `generating ${s.generating} of ${s.parallel}` : "idle";
    $("queue").textContent = s.waiting ? `${s.waiting} more waiting for a turn` : "";
    if (s.running.length) {
      const r = s.running[0];
      showFigures(r, "live", `answer in progress: ${r.tokens} tokens so far` + (s.running.length > 1 ? ` (1 of ${s.running.length})` : ""));
    } else if (lastAnswer && panel.dataset.source !== "answer") {
      onGeneration(lastAnswer);
    }
    const c = s.cache;
    $("resident_mib").textContent = c.streaming ? mib(c.resident_mib) : "all mapped (no streaming)";
    $("budget_mib").textContent = !c.streaming ? "–" : c.budget_mib > 0 ? mib(c.budget_mib) : "no cache";
    $("full_mib").textContent = c.streaming ? mib(c.full_mib) + (c.holds_every_expert ? " (all fit)" : "") : "–";
    $("limit").textContent = s.memory.limit;
    $("room_mib").textContent = mib(s.memory.room_mib);
    for (const id of ["resident_mib", "budget_mib", "full_mib"]) $(id).dataset.value = String(c[id]);
    drawResidency(s.residency);
  }

  function drawResidency(layers) {
    const canvas = $("heatmap");
    if (!layers.length) {
      canvas.hidden = true;
      $("resident_share").textContent = "";
      return;
    }
    canvas.hidden = false;
    const experts = Math.max(...layers.map((l) => l.experts.length));
    const cell = Math.max(1, Math.min(16, Math.floor(320 / experts)));
    const row = Math.max(2, Math.min(cell, Math.floor(160 / layers.length)));
    canvas.width = experts * cell;
    canvas.height = layers.length * row;
    const g = canvas.getContext("2d");
    const style = getComputedStyle(document.documentElement);
    g.fillStyle = style.getPropertyValue("--cold");
    g.fillRect(0, 0, canvas.width, canvas.height);
    g.fillStyle = style.getPropertyValue("--hot");
    let on = 0;
    let all = 0;
    layers.forEach((l, y) => {
      for (let x = 0; x < l.experts.length; x++) {
        all++;
        if (l.experts[x] === "1") {
          on++;
          g.fillRect(x * cell, y * row, Math.max(1, cell - 1), Math.max(1, row - 1));
        }
      }
    });
    canvas.dataset.resident = String(on);
    $("resident_share").textContent = `${on} of ${all} (${fixed((100 * on) / all, 0)}%), ${layers.length} layers × ${experts}`;
  }

  function link(state, text) {
    $("link").dataset.state = state;
    $("link").textContent = text;
  }

  /** Follow /v1/bmoe/events until the page closes; reconnects after a drop (a restart, a network blip). */
  async function watch() {
    if (watching) watching.abort();
    const controller = (watching = new AbortController());
    while (!controller.signal.aborted) {
      try {
        const response = await fetch("/v1/bmoe/events", { headers: headers(), signal: controller.signal });
        if (response.status === 401) {
          const message = await errorText(response);
          link("error", "API key needed");
          needKey(message);
          return; // a new key restarts it
        }
        if (!response.ok) throw new Error(await errorText(response));
        link("live", "live");
        for await (const ev of sseEvents(response)) {
          const data = JSON.parse(ev.data);
          if (ev.event === "snapshot") onSnapshot(data);
          else if (ev.event === "generation") onGeneration(data);
        }
        link("connecting", "server closed the stream");
      } catch (e) {
        if (controller.signal.aborted) return;
        link("error", "offline");
      }
      await new Promise((done) => setTimeout(done, 2000));
    }
  }

  // ---- settings and wiring ------------------------------------------------------------------------

  function loadSettings() {
    const saved = JSON.parse(localStorage.getItem(STORE.settings) || "{}");
    for (const name of [...SAMPLING, "system"]) if (saved[name] !== undefined) $(name).value = saved[name];
    $("api_key").value = localStorage.getItem(STORE.key) || "";
  }

  function saveSettings() {
    const out = {};
    for (const name of [...SAMPLING, "system"]) out[name] = $(name).value;
    localStorage.setItem(STORE.settings, JSON.stringify(out));
  }

  document.addEventListener("DOMContentLoaded", () => {
    loadSettings();
    for (const name of [...SAMPLING, "system"]) $(name).addEventListener("change", saveSettings);
    $("api_key").addEventListener("change", () => {
      const key = $("api_key").value.trim();
      if (key) localStorage.setItem(STORE.key, key);
      else localStorage.removeItem(STORE.key);
      $("settings").classList.remove("needs-key");
      $("api_key").classList.remove("needs-key");
      watch();
    });
    $("ask").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || running) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        $("ask").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => running && running.controller.abort());
    $("clear").addEventListener("click", () => {
      if (running) running.controller.abort();
      history = [];
      $("conversation").replaceChildren();
    });
    setBusy(false);
    watch();
  });
})();
