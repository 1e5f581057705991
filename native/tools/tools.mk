# placeholder: filled in by the tools work
tools:
	@true
