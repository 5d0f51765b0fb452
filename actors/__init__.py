"""Thin Ray actor shells and the one factory that picks local or Ray execution."""

from actors.draft import DraftActor
from actors.factory import Workers, start_workers
from actors.generator import GeneratorActor
from actors.reward import RewardActor

__all__ = ["DraftActor", "GeneratorActor", "RewardActor", "Workers", "start_workers"]
