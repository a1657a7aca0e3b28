"""Training: the study's recipe as a typed config, one resumable loop for one run or a stack.

    config     TrainConfig, load_train_config: the recipe, validated before anything is written
    schedule   the learning-rate schedules (warm-up, then cosine or linear decay)
    stacked    StackedModels, StackedAdamW: K models of one shape as one
    loop       train(config, run_dir), train_stacked(configs, run_dirs)
    timing     step times, for a sweep's estimate

The package imports none of its modules here: the run folder (mecheval.run_folder) reads
`config` and `loop` writes the run folder, so the two import in one direction only.
"""
