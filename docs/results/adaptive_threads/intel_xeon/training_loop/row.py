"""One adaptive_wikitext2 adaptive row for a short budget; argv: name, gradient_in_forward (none/true/false), seconds."""
import json, os, sys
name, gif, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
from keras_softmax_heads.training.studies import study_config
from keras_softmax_heads.training.loop import train_and_evaluate
opts = {} if gif == "none" else {"gradient_in_forward": gif == "true"}
config = study_config("adaptive_wikitext2", "adaptive", dataset="wikitext2",
                      data_dir="/work/shared/data/wikitext-2", train_seconds=seconds,
                      head_options=opts)
res = train_and_evaluate(config, os.path.join(os.environ.get("OUT", "/work/loopcheck"), name))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/work/loopcheck"), name + ".json"), "w"), indent=1, default=str)
print({k: res[k] for k in res if not isinstance(res[k], (dict, list))})
