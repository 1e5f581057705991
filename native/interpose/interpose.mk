# placeholder: filled in by the interpose work
interpose:
	@true
