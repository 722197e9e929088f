// The idem console's only script: it keeps the overview live, and lets a
// "Back" link go back. Pages work without it.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  for (const a of document.querySelectorAll("a[data-back]")) {
    a.addEventListener("click", (e) => {
      if (history.length > 1) {
        e.preventDefault();
        history.back();
      }
    });
  }
  if (document.getElementById("records-stale")) {
    live();
  }
});

// live polls the overview's numbers every 2 seconds and shows the rates
// between two polls.
function live() {
  let last = null;
  const set = (id, text) => {
    const el = document.getElementById(id);
    if (el && el.textContent !== text) {
      el.textContent = text;
    }
  };
  const tick = async () => {
    try {
      const res = await fetch("/console/api/overview", { headers: { Accept: "application/json" } });
      if (!res.ok) {
        throw new Error("HTTP " + res.status);
      }
      const d = await res.json();
      const at = Date.parse(d.at);
      if (d.counts) {
        const req = d.counts.requests || {};
        for (const o of d.outcomes) {
          set("total-" + o, String(req[o] || 0));
          if (last) {
            const secs = (at - last.at) / 1000;
            const prev = (last.counts.requests || {})[o] || 0;
            set("rate-" + o, secs > 0 ? (((req[o] || 0) - prev) / secs).toFixed(1) : "-");
          }
        }
        for (const o of ["completed", "failed"]) {
          set("reconciled-" + o, String((d.counts.reconciled || {})[o] || 0));
        }
        for (const k of ["stale", "waiting", "unknown"]) {
          set("pass-" + k, String((d.counts.last_pass || {})[k] || 0));
        }
        set("store-calls", String(d.counts.store_calls));
        set("store-errors", String(d.counts.store_errors));
        if (last) {
          const secs = (at - last.at) / 1000;
          const calls = d.counts.store_calls - last.counts.store_calls;
          const time = d.counts.store_seconds - last.counts.store_seconds;
          set("store-rate", secs > 0 ? (calls / secs).toFixed(1) : "-");
          set("store-latency", calls > 0 ? ((time / calls) * 1000).toFixed(2) + " ms" : "-");
        }
      }
      const states = d.records.states || {};
      for (const st of ["in_progress", "unknown", "completed", "failed"]) {
        set("records-" + st, String(states[st] || 0));
      }
      set("records-stale", String(d.records.stale));
      set("oldest-stale", d.oldest_stale_age || "-");
      document.getElementById("capped").hidden = !d.records.capped;
      set("updated", "Last update: " + new Date(at).toLocaleTimeString() + ".");
      last = { at, counts: d.counts };
    } catch (err) {
      set("updated", "Could not update: " + err.message + "; trying again.");
    }
    setTimeout(tick, 2000);
  };
  tick();
}
