"""Turn a Plan into what a trainer or a person consumes: framework configs, schedule CSVs, pictures."""
