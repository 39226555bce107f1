"""The lookups and scatters of plif_torch at one and two threads (session 53): one 320,000-score tile, K = 1e5, median of 40 calls in microseconds; "py threads": the tile split in halves, one half on a Python thread (PyTorch releases the GIL in its ops). Output: ops_two_threads.txt.

    python ops_two_threads.py 1 > ops_two_threads.txt; python ops_two_threads.py 2 >> ops_two_threads.txt
"""
import torch, time, sys
from concurrent.futures import ThreadPoolExecutor
T=int(sys.argv[1]); torch.set_num_threads(T)
K=100000; n=32*10000
g = torch.Generator().manual_seed(0)
z = torch.randn(n, generator=g)*2
tab = torch.randn(K)
idx64 = ((z+20)/(40/K)).floor().clamp(0,K-1).long()
idx32=idx64.int()
out = torch.empty(n); w = torch.randn(n)
def t(f, reps=40):
    f(); ts=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]*1e6
pool = ThreadPoolExecutor(2)
h=n//2
def halves_select():
    f1=pool.submit(torch.index_select, tab, 0, idx64[:h], out=out[:h])
    torch.index_select(tab,0,idx64[h:],out=out[h:]); f1.result()
a=torch.zeros(K); a2=torch.zeros(K)
def halves_scatter():
    f1=pool.submit(a.scatter_add_, 0, idx64[:h], w[:h])
    a2.scatter_add_(0, idx64[h:], w[h:]); f1.result()
for name,f in [("index_select i64 out", lambda: torch.index_select(tab,0,idx64,out=out)),
  ("take i64", lambda: torch.take(tab, idx64)),
  ("gather i64", lambda: torch.gather(tab,0,idx64)),
  ("tab[idx64]", lambda: tab[idx64]),
  ("halves index_select (py threads)", halves_select),
  ("scatter_add_ i64", lambda: a.scatter_add_(0, idx64, w)),
  ("index_add_ i64", lambda: a.index_add_(0, idx64, w)),
  ("index_put_ acc", lambda: a.index_put_((idx64,), w, accumulate=True)),
  ("halves scatter_add (py threads)", halves_scatter),
  ("add out", lambda: torch.add(z,1.0,out=out)),
  ("exp out", lambda: torch.exp(z,out=out)),
  ]:
    print(f"T={T} {name:35s} {t(f):9.1f}")
