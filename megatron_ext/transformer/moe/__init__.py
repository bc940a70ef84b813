"""Mixture of experts."""
