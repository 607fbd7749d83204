// Kept free of LibTorch headers: the training code lives in a library that
// shares the worker's precompiled header (executables are built -fPIE, the
// header -fPIC).
int ConcordTrainMain(int argc, char** argv);

int main(int argc, char** argv) { return ConcordTrainMain(argc, argv); }
