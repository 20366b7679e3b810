"""``flatzero bench host-ops``: operator calls per param in backward and in the step."""
