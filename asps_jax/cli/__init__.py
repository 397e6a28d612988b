"""The command line (``asps-jax sample``, ``python -m asps_jax``, ``scripts/sample.py``) as library
modules: ``main`` (the command's flow: Ctrl-C and the notices, start-up, the step loops, the exit
status), ``flags`` (the flags' argparse types), ``args`` (the parser, its checks, the flags as
library arguments), ``output`` (what the command prints) and ``prompts`` (``--prompts FILE``
through a Session).
"""
