"""The collectives playground (nccl-tests style) and the compute/communication overlap study.

    distlab run --nproc 8 -m distlab.collectives --op all -b 8 -e 1G -f 2
    distlab run --nproc 2 -m distlab.collectives.overlap --size 256M --gemm 8192
"""
