"""Interactions: simulated users that answer each assistant turn (verl's ``BaseInteraction``)."""
