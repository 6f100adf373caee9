"""The example budget of a slow property test: fewer examples under the CI profile, the
profile's own count elsewhere (``dev`` locally, ``CFX_HYPOTHESIS=sweep`` for the large sweep)."""
from hypothesis import settings


def examples(ci: int) -> settings:
    """``@examples(ci=5)``: 5 examples under CI, the loaded profile's count otherwise."""
    ci_profile = settings.get_current_profile_name() == "ci"
    return settings(max_examples=ci if ci_profile else settings.default.max_examples)
