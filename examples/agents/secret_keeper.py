"""A toy environment (docs/agents.md): each episode hides a digit behind a key, and only the lookup tool tells it.

The model must call ``lookup`` with the prompt's key, then answer with the digit it returned; the reward
(``astrai.rewards:exact_answer`` on the record's ``answer``) is 1 for the right digit.
"""


class SecretKeeper:
    """One instance per episode; its public methods are the model's tools."""

    def reset(self, key: str, answer: str) -> None:
        """Start an episode: the record's key and the digit it hides (the record's fields)."""
        self.key, self.secret = key, answer
        self.lookups = 0

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key, as the question names it.
        """
        self.lookups += 1
        if key != self.key:
            raise KeyError(f"no key {key}")
        return self.secret
