"""Remediation sub-agents (constrained, durable, causally linked). Built in a later release."""
