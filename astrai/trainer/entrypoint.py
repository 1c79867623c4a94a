"""``python -m astrai.trainer.entrypoint``: the container's entrypoint, by the name built images, Slurm scripts and
rendered manifests give it (:mod:`astrai.trainer.launch.entrypoint` holds it). Imports no torch."""

import sys

from astrai.trainer.launch.entrypoint import main

if __name__ == "__main__":
    sys.exit(main())
