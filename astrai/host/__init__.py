"""The host layer: validate train.yaml's runtime block, render Compose files, drive the Docker engine.

Imports neither torch nor Invoke (tasks.py is the thin Invoke shell over these modules).
"""
