"""What every recipe section is: a strict pydantic model whose checks across fields run once its fields are
valid, and whose checks against the model's config (which need transformers) can be left to a second pass.
See ``recipe/schema.py`` for the two passes."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError, PydanticUndefined

# the validation context that leaves the model-config checks to the second pass (recipe_from_dict)
DEFER_MODEL_CHECKS = "defer_model_checks"
# (path inside its section, "what is wrong; what would fix it"); path "" is the section itself
Problem = Tuple[str, str]


def _field(default: Any = PydanticUndefined, fix: Optional[str] = None, example: Any = None, **kwargs) -> Any:
    """A pydantic Field carrying the fix for a range error and an example value for a type error."""
    extra = {k: v for k, v in (("fix", fix), ("example", example)) if v is not None}
    return Field(default, json_schema_extra=extra or None, **kwargs)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def _problems(self) -> List[Problem]:
        """Checks across fields; they run once every field of the section has a valid type and range."""
        return []

    def _model_config_problems(self) -> List[Problem]:
        """Checks that need transformers (the second pass); they run after ``_problems`` found nothing."""
        return []

    @model_validator(mode="after")
    def _check_across_fields(self, info: ValidationInfo):
        problems = self._problems()
        if not problems and not (info.context or {}).get(DEFER_MODEL_CHECKS):
            problems = self._model_config_problems()
        if problems:
            # a ValidationError raised here joins the other sections' errors, each at its own field
            raise ValidationError.from_exception_data(
                type(self).__name__,
                [
                    InitErrorDetails(
                        type=PydanticCustomError("recipe", "{message}", {"message": message}),
                        loc=tuple(path.split(".")) if path else (),
                        input=None,
                    )
                    for path, message in problems
                ],
            )
        return self
