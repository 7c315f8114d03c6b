"""
The run's aids, which every step may use and which know nothing of models or ranks. Read in this order:

  common.py       one-line errors, every script's --help format, the cache folder, atomic writes
  progress.py     how long: the forecast before the first step, the step line's ETA, progress lines of long passes
  checkpoints.py  run folders: checkpoint names, .pt files written whole and checked on load, pruning, the lock
  inputs.py       what a run reads besides its arguments: the token shards' id check, OpenAI's weights
  report.py       every run's picture: log_dir/report.png and report.md from its log.txt (and plot.py's)
"""
