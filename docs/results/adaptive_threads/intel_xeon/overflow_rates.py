"""How often a static tail's first block overflows on real text, by capacity_factor.

WikiText-2's training stream in the training scripts' batches
(`data.stream_windows`: `batch_size` streams of `bptt` tokens, N = their
product per step), the head as the `adaptive_wikitext2` study builds it
(`AdaptiveSoftmax(33278, cutoffs=[2000, 10000], factor=4, counts=<training
counts>)`), for each `capacity_factor`: the share of steps in which a tail has
more members than its capacity `K_i` (one overflow block more, recomputed in
the backward pass), and the rows scored per member in the steps that do not
overflow (`K_i / members`: the padding the step pays for). No training, counts
only; NumPy and the layer's `tail_capacities`.

    python docs/results/adaptive_threads/intel_xeon/overflow_rates.py \
        --data_dir=../shared/data/wikitext-2 --out=overflow_rates.json
"""

import json
import os

import numpy as np
from absl import app
from absl import flags

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
flags.DEFINE_string("data_dir", None, "WikiText-2 directory (train.txt, ...).")
flags.DEFINE_list("factors", ["1.0", "1.1", "1.25"], "capacity_factor values.")
flags.DEFINE_list("batches", ["20x35", "20x20", "64x32"], "batch_size x bptt.")
flags.DEFINE_integer("blocks", 8, "The summed kernel's blocks per capacity.")
flags.DEFINE_string("out", None, "JSON output.")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    import keras_softmax_heads as ksh
    from keras_softmax_heads.data import load_dataset
    from keras_softmax_heads.data.batching import stream_windows
    from keras_softmax_heads.data.batching import word_counts
    from keras_softmax_heads.heads.adaptive_softmax import fewest_scored_blocks
    from keras_softmax_heads.heads.adaptive_softmax import split_capacity

    corpus = load_dataset("wikitext2", data_dir=FLAGS.data_dir)
    v = len(corpus.vocab)
    counts = word_counts(corpus.train, v)
    cutoffs = [2000, 10000]
    rows = []
    for shape in FLAGS.batches:
        batch_size, bptt = (int(x) for x in shape.split("x"))
        _, targets = stream_windows(corpus.train, batch_size, bptt)
        n = batch_size * bptt
        for factor in (float(f) for f in FLAGS.factors):
            head = ksh.AdaptiveSoftmax(v, cutoffs=cutoffs, factor=4, counts=counts,
                                       capacity_factor=factor)
            capacities = head.tail_capacities(n)
            rank = np.argsort(np.argsort(-counts, kind="stable"), kind="stable")
            # A word's rank by training count (the layer's frequency order).
            ranks = rank[targets.reshape(len(targets), -1)]
            edges = cutoffs + [v]
            row = {"batch": shape, "tokens": n, "capacity_factor": factor,
                   "steps": int(len(targets)), "capacities": capacities, "tails": []}
            for i, k in enumerate(capacities):
                members = ((ranks >= edges[i]) & (ranks < edges[i + 1])).sum(axis=1)
                fits = members <= k
                block, kept = split_capacity(k, n, FLAGS.blocks)
                needed = np.maximum(1, -(-members // block))  # past `kept`: the overflow loop
                lowest = fewest_scored_blocks(kept, FLAGS.blocks, FLAGS.blocks // 2)
                row["tails"].append({
                    "fraction": float(head.tail_fractions[i]),
                    "members_mean": float(members.mean()), "members_max": int(members.max()),
                    "overflow_rate": float(1.0 - fits.mean()),
                    "rows_per_member_no_overflow": float(k / max(members[fits].mean(), 1e-9)),
                    "members_min": int(members.min()),
                    "summed_rows_per_member": float((needed * block).sum() / members.sum()),
                    "summed_rows_per_member_half": float(
                        (np.maximum(needed, lowest) * block).sum() / members.sum()),
                    "below_half_rate": float((needed < lowest).mean()),
                })
            rows.append(row)
            print(shape, factor, capacities,
                  [(round(t["members_mean"], 1), t["members_max"], round(t["overflow_rate"], 4),
                    round(t["rows_per_member_no_overflow"], 3), t["members_min"],
                    round(t["summed_rows_per_member"], 3),
                    round(t["summed_rows_per_member_half"], 3), round(t["below_half_rate"], 4))
                   for t in row["tails"]], flush=True)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"vocab_size": v, "cutoffs": cutoffs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
