"""Shared pytest setup: the fixture harness lives in tests/fixtures.py."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
