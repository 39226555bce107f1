"""The single PyTorch ops behind plif_torch's choices (session 51): one 320,000-score tile (32 x 10,000), K = 1e5, one thread, median of 30 calls in microseconds. Output: ops_microbenchmark.txt.

    taskset -c 0 python ops_microbenchmark.py > ops_microbenchmark.txt
"""
import torch, time
torch.set_num_threads(1)
K=100000; n=32*10000
g = torch.Generator().manual_seed(0)
z = torch.randn(n, generator=g)*2
tab = torch.randn(K); tab2 = torch.randn(K)
idx32 = ((z+20)/(40/K)).floor().clamp(0,K-1).to(torch.int32)
idx64 = idx32.long()
pk = torch.stack([tab, tab2], 1).contiguous()
out = torch.empty(n)
w = torch.randn(n)
def t(f, reps=30):
    f(); ts=[]
    for _ in range(reps):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    ts.sort(); return ts[len(ts)//2]*1e6
print("index_select i32", t(lambda: torch.index_select(tab, 0, idx32)))
print("index_select i64", t(lambda: torch.index_select(tab, 0, idx64)))
print("index_select i32 out", t(lambda: torch.index_select(tab, 0, idx32, out=out)))
print("index_select i64 out", t(lambda: torch.index_select(tab, 0, idx64, out=out)))
print("take i64", t(lambda: torch.take(tab, idx64)))
print("gather i64", t(lambda: torch.gather(tab, 0, idx64)))
print("tab[idx64]", t(lambda: tab[idx64]))
print("embedding packed", t(lambda: torch.nn.functional.embedding(idx64, pk)))
print("index_select packed", t(lambda: torch.index_select(pk, 0, idx64)))
print("to int32", t(lambda: z.to(torch.int32)))
print("to int64", t(lambda: z.to(torch.int64)))
a = torch.zeros(K)
print("index_add_ i32", t(lambda: a.index_add_(0, idx32, w)))
print("index_add_ i64", t(lambda: a.index_add_(0, idx64, w)))
print("scatter_add_ i64", t(lambda: a.scatter_add_(0, idx64, w)))
print("bincount", t(lambda: torch.bincount(idx64, w, minlength=K)))
print("copy", t(lambda: out.copy_(z)))
print("add alloc", t(lambda: torch.add(z, 1.0)))
print("add out", t(lambda: torch.add(z, 1.0, out=out)))
