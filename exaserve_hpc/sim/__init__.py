"""The simulator: the running controller core and router dispatcher in simulated time (simulation.py)."""
