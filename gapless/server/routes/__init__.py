"""The API server's routes by endpoint family: `openai` (completions, chat), `native` (/generate) and
`admin` (health, models, metrics, debug state). `generation` holds what the generation endpoints share,
`common` what every route does."""
