"""
Runs side by side: the logs of one or more train_gpt2.py runs drawn into one PNG.

    python plot.py log_demo                      # one run -> plot.png
    python plot.py log_a log_b -o compare.png    # two runs overlaid, one colour each

Each run draws train and val loss against tokens and against hours of training, HellaSwag or task
accuracy when its log has them, and tokens/s (plumbing/report.py draws it; a run's own report.png
is the same picture of that run alone). Headless: no display needed.
"""
import argparse

from plumbing import report
from plumbing.common import ShowDefaults


def main(argv=None):
    p = argparse.ArgumentParser(description="Overlay the logs of train_gpt2.py runs in one PNG.",
                                formatter_class=ShowDefaults)
    p.add_argument("log_dirs", nargs="+", metavar="log_dir", help="a run's --log_dir (its log.txt and args.json)")
    p.add_argument("-o", "--output", default="plot.png", help="the PNG to write")
    args = p.parse_args(argv)
    runs = [report.Curves(log_dir) for log_dir in args.log_dirs]  # every log read (and checked) before drawing
    fig = report.draw(runs, args.output)
    print(f"{args.output}: {len(runs)} run(s): " + ", ".join(
        f"{run.label} ({len(run.streams.get('train', {}))} steps)" for run in runs))
    return fig


if __name__ == "__main__":
    main()
