"""The exit status of train.py (each rank) and of the launcher, in one place: the README's table, and what
nsa_training/launch.py reads back from its ranks. A run stopped by SIGTERM / SIGINT after its checkpoint exits with
128 + the signal's number (143, 130), as schedulers expect."""

BAD_INPUT_EXIT_CODE = 2  # a ConfigError: one `error:` line naming the key and the fix, nothing started or written
HANG_EXIT_CODE = 3  # a rank stalled past debug.hang_timeout_s (the first step: debug.init_timeout_s)
DIVERGED_EXIT_CODE = 4  # training.max_skipped_steps non-finite steps in a row
COLLECTIVE_EXIT_CODE = 5  # a collective failed: another rank died or stalled past debug.collective_timeout_s
OOM_EXIT_CODE = 6  # out of memory, or an estimate beyond the free memory before the start
WRITE_FAILED_EXIT_CODE = 7  # a checkpoint could not be written; the previous one stays the one to resume from
