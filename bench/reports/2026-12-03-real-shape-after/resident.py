"""demo64, every expert resident once filled, file warm: bmoe --cache-mb 8000 vs plain --no-stream, per-token
median of tokens 65-128 (filled) and 1-48 (filling), interleaved rounds."""
import csv, statistics as st, subprocess, sys
from pathlib import Path
M = str(Path.home() / ".cache/bmoe/smollm2-135m-moe-e64-k8-r2.gguf")
PY = sys.executable
P = "Write a long story about a dragon who learns to bake bread, with many characters and places."
arms = {"plain": ["--no-stream"], "bmoe": ["--cache-mb", "8000", "--no-warm-start", "--io-threads", "4"]}
subprocess.run(["cat", M], stdout=subprocess.DEVNULL)  # the file warm
res = {a: [] for a in arms}
for rnd in range(int(sys.argv[1])):
    for a, flags in arms.items():
        out = f"/tmp/res-{a}-{rnd}.csv"
        r = subprocess.run([PY, "-m", "bmoe.cli", "-m", M, "-p", P, "-n", "128", "-t", "2", "--csv", out, *flags],
                           capture_output=True, text=True)
        rows = [x for x in csv.DictReader(open(out)) if x.get("wall_ms")]
        w = [float(x["wall_ms"]) for x in rows]
        filled, filling = st.median(w[64:128]), st.median(w[0:48])
        res[a].append((filled, filling))
        print(a, rnd, r.returncode, len(w), "filled", round(filled, 1), "filling", round(filling, 1), r.stdout[:40].replace("\n", " "), flush=True)
for a in arms:
    print(a, "median filled", round(st.median(x[0] for x in res[a]), 1), "filling", round(st.median(x[1] for x in res[a]), 1))
p, b = res["plain"], res["bmoe"]
print("bmoe/plain speed filled", round(st.median(x[0] for x in p) / st.median(x[0] for x in b), 3),
      "filling", round(st.median(x[1] for x in p) / st.median(x[1] for x in b), 3))
