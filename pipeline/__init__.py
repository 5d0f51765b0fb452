"""Distributed Best-of-N / speculative-rejection preference-data pipeline (library, Ray-free)."""
