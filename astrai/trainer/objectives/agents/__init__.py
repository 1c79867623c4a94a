"""Agents: the online types' episodes, in which the model acts over several turns with tools, in an environment.

:mod:`.tools` loads the tools and answers their calls; :mod:`.environments` is the environment an episode runs in (a
class in this process, or a server beside the trainer); :mod:`.episodes` plays a step's episodes on the generation
engine and scores them (a rollout source of the objectives).
"""
