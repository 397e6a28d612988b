"""The command line of ``scripts/sample.py`` as library modules: ``flags`` (the flags' argparse
types), ``args`` (the parser, its checks, the flags as library arguments), ``output`` (what the
command prints) and ``prompts`` (``--prompts FILE`` through a Session). The script keeps the flow:
Ctrl-C and the notices (set up before any of this is imported), start-up, the step loops and the
exit status.
"""
