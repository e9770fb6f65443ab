const char msg[] = "hi";
int f(void){return msg[0];}
