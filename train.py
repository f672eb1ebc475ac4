"""Train an NSA (or dense) language model from a TOML recipe.

    ./run.sh recipes/debug.toml --training.steps 100          # via torchrun (any number of processes)
    python train.py recipes/debug.toml --print-config          # resolved config, nothing else
    python train.py --help [SECTION]                            # the sections, or a section's keys and docs

The recipe is parsed before torch is imported, so a bad key fails in a fraction of a second with one line.
Exit status (declared in nsa_training/exit_codes.py): 0 done; 2 bad input; 3 a rank stalled (stacks in
<run_dir>/hang); 4 too many non-finite steps in a row; 5 a collective failed (another rank died or stalled); 6 out of
memory; 7 a checkpoint could not be written (disk full or not writable); 128 + signal number (143, 130) when
SIGTERM/SIGINT stopped the run after writing a checkpoint.
"""

from __future__ import annotations

import os
import sys

from nsa_training.config import ConfigError, config_to_toml, help_text, help_topic, load_config
from nsa_training.watchdog import RunFailed, exit_with_launcher, report_failure


def main(argv: list[str] | None = None) -> int:
    exit_with_launcher()
    argv = sys.argv[1:] if argv is None else argv
    try:
        topic = help_topic(argv)
        if topic is not None:
            print(help_text(topic), end="")
            return 0
        config, print_only = load_config(argv)
        if print_only:
            print(config_to_toml(config), end="")
            return 0
        from nsa_training.trainer import Trainer  # imports torch: after the recipe is known to be good

        return Trainer(config).train()
    except (ConfigError, RunFailed) as e:
        return report_failure(e)


def exit_now(code: int) -> None:
    """Exit skipping interpreter teardown: gloo's threads can abort the process at teardown ("terminate called
    without an active exception", SIGABRT) after a run that succeeded. Everything is flushed and closed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
