"""`exaserve launch`: what every rank of a batch job runs (rank.py), and rank 0's requeue watch
(requeue_watch.py). The batch system is reached only through jobenv/."""
