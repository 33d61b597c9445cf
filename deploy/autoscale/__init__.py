"""The SLO autoscaler: a planner in the controller that moves autoscaled pools between their
bounds by what the gateway observes (decide.py: the pure decision; observe.py and window.py:
from the gateways' load reports to one observation per pool; planner.py: the loop that acts
through the controller's converge; resources.py: what it asks of Ray's autoscaler)."""
