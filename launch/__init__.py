"""Launch helpers: sbatch scripts (``launch/*.sh``) and the submitit submitter (``python -m launch.submit``)."""
