"""Support for the benchmark scripts under bench/: the training sweep (`sweep`) that bench/compile_sweep.py, e2e.py,
scaling.py, profile_step.py and retrieval.py run. Sits above the training package (it launches train.py and reads
nsa_training's errors); nothing under nsa_models, parallelisms or nsa_training imports it."""
