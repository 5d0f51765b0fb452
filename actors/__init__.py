"""Thin Ray actor shells and the one factory that picks local or Ray execution."""

from actors.factory import Workers, start_workers
from actors.generator import GeneratorActor
from actors.reward import RewardActor

__all__ = ["GeneratorActor", "RewardActor", "Workers", "start_workers"]
