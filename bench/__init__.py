"""Benchmarks: each module measures one target and prints a JSON result on standard output.

Logs of the programs and fakes a benchmark runs in-process go to standard error, warnings only, so that standard
output is the JSON document alone.
"""

from spotdrain.logs import configure_logging

configure_logging(json=False, level="warning")
