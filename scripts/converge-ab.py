#!/usr/bin/env python3
"""Diagnostic A/B for convergence: `scripts/converge-ab.py BOXERY_BINARY N`.

Runs `boxery serve` on the fake backend in a temporary home, applies N Vms at once, polls
the store until every Vm is Ready, prints the time, `serve`'s RSS 3 s later (idle), and the
number of log rows per kind and change type (how many writes convergence took). Run it with
two binaries, interleaved, to compare them in one session (docs/benchmarks.md)."""
import json, os, sqlite3, subprocess, sys, tempfile, time

B, N = sys.argv[1], int(sys.argv[2])
H = tempfile.mkdtemp()
env = dict(os.environ, BOXERY_HOME=H, BOXERY_BACKEND="fake")
with open(f"{H}/vms.yaml", "w") as f:
    for i in range(N):
        f.write(f"apiVersion: boxery.dev/v1alpha1\nkind: Vm\nmetadata: {{name: vm-{i:04}}}\nspec: {{source: {{image: debian-12}}}}\n---\n")
subprocess.run([B, "get", "vms"], env=env, capture_output=True)
sp = subprocess.Popen([B, "serve", "--inventory-every", "5s"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    time.sleep(1.5)
    t0 = time.time()
    subprocess.run([B, "apply", "-f", f"{H}/vms.yaml"], env=env, capture_output=True, check=True)
    db = sqlite3.connect(f"{H}/store.db")
    while True:
        n = 0
        for (j,) in db.execute("select json from objects where kind='Vm'"):
            o = json.loads(j)
            if any(c["type"] == "Ready" and c["status"] == "True" for c in o.get("status", {}).get("conditions", [])):
                n += 1
        if n == N: break
        time.sleep(0.05)
    t1 = time.time()
    print(f"converge {t1-t0:.2f} s")
    time.sleep(3)
    with open(f"/proc/{sp.pid}/status") as st:
        rss = next(int(l.split()[1]) for l in st if l.startswith("VmRSS:"))
    print(f"idle rss {rss / 1024:.1f} MiB")
    for row in db.execute("select kind,type,count(*) from log group by kind,type"): print(row)
finally:
    sp.kill(); sp.wait()
    subprocess.run(["rm", "-rf", H])
