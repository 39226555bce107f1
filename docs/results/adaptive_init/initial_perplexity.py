"""The initial perplexity of a few heads on uniform random targets (session 53): python initial_perplexity.py 10000 256 (KSH_CLUSTER_INIT: see cluster_bias.patch)."""
import os, sys, numpy as np, keras, keras_softmax_heads as ksh
V=int(sys.argv[1]); D=int(sys.argv[2]); T=8
rng=np.random.default_rng(0)
x=rng.integers(0,V,size=(256,T)).astype("int32"); y=rng.integers(0,V,size=(256,T)).astype("int32")
for name,kw in [("FullSoftmax",{}),("AdaptiveSoftmax",{"cutoffs":[V//5,V//2]}),("AdaptiveSoftmax",{}),("HierarchicalSoftmax",{}),("DifferentiatedSoftmax",{}) ]:
  for act in ["tanh", None]:
    keras.utils.set_random_seed(0)
    try: head=getattr(ksh,name)(V,**kw)
    except Exception as e: print(name, kw, "ERR", e); continue
    m=keras.Sequential([keras.Input((T,),dtype="int32"),keras.layers.Embedding(V,D),keras.layers.Dense(D,activation=act),head])
    m.compile("adam",loss=ksh.HeadLoss(head),metrics=[ksh.Perplexity()])
    ev=m.evaluate(x,y,verbose=0,return_dict=True)
    lp=np.asarray(m.predict(x,verbose=0)); ent=-(np.exp(lp)*lp).sum(-1).mean()
    print(f"{name:22s} {str(kw):30s} act={act} ppl0={ev['perplexity']:.0f} (uniform {V}) mean entropy exp={np.exp(ent):.0f}")
