"""``canteen up``: the four services as supervised processes on one machine.

layout.py      the ports and each child's command line
policy.py      when a child that exited is started again (backoff, giving up)
state.py       the state file other tools read: children, PIDs, ports, restarts
supervisor.py  one child: start, watch its health, restart it, stop it
launcher.py    the suite: lock the data folder, start, wait ready, stop in order
cli.py         the ``canteen up`` flags
"""
