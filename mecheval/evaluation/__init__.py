"""The evaluation side: from trained run folders to the report.

Each module imports only those above it in this list, so the data flows one way (evaluate ->
analysis -> findings -> report):

    config         EvaluateConfig: the evaluation's settings, defaults and checks
    documents      a run's evaluation documents, corrupted, positions checked
    over_training  the read-outs of every checkpoint a run kept
    evaluate       evaluate_run / evaluate_all: the interchange grids of finished runs
    analysis       tables from the evaluated runs (read-outs with intervals, over training,
                   by distance)
    shipped        the measured tables shipped as CSV beside the modules
    study_numbers  the study's own accuracies, and whether a run is at its scale
    findings       the study's five findings, judged on the analysis' tables
    results        the finished runs' table; the best learning rate of each model, the
                   study's accuracy and the seeds' spread beside it
    svg_figure     a figure written as PNG and as inline SVG with values on hover
    plots          the report's figures
    overview       the report's first figure: architecture by read-out, the findings beside
    display        how tables show in the report: cell text, splits, the findings' evidence,
                   read-outs with their intervals
    report_html    report.html: one page, no server, no script
    report         build_report: Markdown, HTML, PNG and Parquet

Every file they read or write in a run folder is named, read and written by
mecheval.run_folder. The package imports none of its modules here, so that the command line can
load the light `config` alone.
"""
