"""The run folder: one training run and its evaluation, on disk. This package alone knows the
names and formats of its files; training, sweeps, evaluation and the report ask it.

    config.yaml                      the resolved training config (TrainConfig as YAML)
    .lock                            held by the one process training in the folder
    checkpoints/step_000000123/      weights, optimiser and RNG state, checksums (checkpoints)
    checkpoints/latest               names the newest complete checkpoint
    metrics.jsonl, metrics.parquet   one record per log or eval step (loss, lr, accuracy, steps/s)
    result.json                      the final result; its presence marks the run finished
    error.json                       why the run failed (written by a sweep)
    interventions.parquet            the interchange grids of its evaluation
    examples.parquet                 per evaluation document: positions, distance, correct
    interventions.json               what the evaluation was computed with, and its files' sha256
    readouts_over_training.parquet   the read-outs of every kept checkpoint (and its .json)
    das.parquet, das_bases.safetensors, das.json   `mecheval das`: IIA, the bases, the stamp

Modules: `files` (every file's name, reader and writer), `checkpoints` (the checkpoint folders),
`weights` (which checkpoint evaluation loads, and the model with its weights), `status` (what
became of each run folder under a path), `provenance` (whether a run's architecture still has
the code it was trained with).
"""

# The step that asks for the newest intact checkpoint (mecheval.run_folder.weights, and the
# evaluation's `step` option). It lives here, beside no import, so that the command line reads
# it without importing torch.
LATEST = "latest"
