"""The data tools: ``python -m astrai.data prepare`` tokenizes a corpus into a data folder.

Torch-free: it runs on the host, in the image or on a laptop alike. The folder
it writes is read by :mod:`astrai.common.data_folder`.
"""
