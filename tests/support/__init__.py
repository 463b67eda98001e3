"""Helpers the tests of several folders share (no tests here)."""
