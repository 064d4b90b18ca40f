"""Drafters: anything that proposes candidate trees for the target to verify."""

from specgraft.heads.base import Drafter
from specgraft.heads.draft_model import DraftModel
from specgraft.heads.prompt_lookup import PromptLookup

__all__ = ["DraftModel", "Drafter", "PromptLookup"]
