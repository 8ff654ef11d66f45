import time, sys
from collections import Counter
from bmoe.coordinator import Engine
from tests.conftest import settings_for
mb = sys.argv[1]
e = Engine(settings_for("/work/models/demo64.gguf", "--cache-mb", mb, "--io-threads", 4, "-t", 2))
st = e.streamer
cnt = Counter()
rel = st.slab.release
def release(a, b):
    cnt["release"] += 1
    t0 = time.perf_counter_ns(); rel(a, b); cnt["release_ns"] += time.perf_counter_ns() - t0
st.slab.release = release
take = st.cache._take
def _take(g, c):
    cnt["take"] += 1
    if not st.cache.warm.get((g, c)): cnt["take_nowarm"] += 1
    return take(g, c)
st.cache._take = _take
toks = e.prompt_tokens("Write a story about a dragon who learns to bake bread.", chat=True)
r = e.generate(toks, 24)
print(mb, dict(cnt), "mgmt/tok", sum(s.mgmt_s for s in r.steps[1:]) / (len(r.steps)-1) if hasattr(r.steps[0], "mgmt_s") else r.steps[-1])
e.close()
