import sys, time
from collections import Counter
from bmoe.coordinator import Engine
from tests.conftest import settings_for
mb = sys.argv[1]
e = Engine(settings_for("/work/models/demo64.gguf", "--cache-mb", mb, "--io-threads", 4, "-t", 2))
st = e.streamer
acc = Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter_ns(); r = f(*a, **k); acc[label] += time.perf_counter_ns() - t0; acc[label + "#"] += 1; return r
    setattr(obj, name, g)
wrap(st.ahead, "on_route", "ahead.on_route"); wrap(st.cache, "plan", "cache.plan"); wrap(st, "_send_demand", "send_demand")
wrap(st.ahead, "after_demand", "ahead.after_demand"); wrap(st, "tick", "tick"); wrap(st.cache, "commit", "commit")
wrap(st, "slot_ids", "slot_ids"); wrap(st.pool, "send", "pool.send"); wrap(st, "_wait", "_wait"); wrap(st, "skip", "skip")
toks = e.prompt_tokens("Write a story about a dragon who learns to bake bread.", chat=True)
e.generate(toks, 4); acc.clear()
r = e.generate(toks, 24)
d = r.steps[1:]
n = len(r.steps)
print(mb, "mgmt ms/tok %.1f" % (sum(s.mgmt_ns for s in d) / len(d) / 1e6))
for k in sorted(acc):
    if not k.endswith("#"): print("  %-20s %6.2f ms/tok  (%d calls)" % (k, acc[k] / n / 1e6, acc[k + "#"]))
e.close()
